"""The shapes bed: a tiny text-to-image world that runs the whole method on a CPU, in one package.

The world (grammar, renderer, split), the bundled model and its weights, its pretraining, the exact and dense
rewards, the bed's evaluation metrics, its prompt sets and sampler, and its presets. It sits above the core and
registers into the core's registries by "module:attr" names, imported only when used: the model `shapes`
(solrl.models), the rewards `shapes` and `shapes_dense` (solrl.rewards), the prompt sets `shapes:*`
(solrl.prompts) and the `shapes-*` presets (solrl.config). No core module imports this package otherwise
(docs/architecture.md); its benchmarks live with the others in solrl/bench/.
"""
