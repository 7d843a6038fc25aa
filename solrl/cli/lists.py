"""`solrl presets`, `solrl models [quantized]`, `solrl rewards`: the registries' listings."""

from __future__ import annotations

import argparse

from solrl.config import PRESETS, ConfigError


def cmd_list(a: argparse.Namespace) -> int:
    if a.what == "presets":
        for n in sorted(PRESETS):
            print(n)
    elif a.what == "models" and a.action == "quantized":
        from solrl.models import load_model
        from solrl.models.architectures import ARCHITECTURES
        from solrl.precision.policy import POLICIES, architecture_share_report, format_report, share_report

        names = a.model or ["shapes", *ARCHITECTURES]
        for name in names:
            try:
                policies = tuple(a.policy or POLICIES)
                if name in ARCHITECTURES and a.path is None:  # counted on the meta device: no weights needed
                    print(format_report(architecture_share_report(name, a.backend, policies)))
                else:
                    print(format_report(share_report(load_model(name, a.path), a.backend, policies)))
            except (FileNotFoundError, ValueError) as exc:
                raise ConfigError(f"models quantized: {exc}") from None
    elif a.what == "models":
        from solrl.models import available_models

        print("\n".join(available_models()))
    else:
        _list_rewards()
    return 0


def _list_rewards() -> None:
    """One line per reward: name, whether it needs downloaded weights, and whether it can be built here."""
    from solrl.rewards import available_rewards, reward_info

    for n in available_rewards():
        info = reward_info(n)
        missing = info.missing()
        status = "ready" if not missing else "missing: " + "; ".join(missing)
        weights = f"needs weights: {info.weights}" if info.needs_weights else "no weights"
        print(f"{n:<22} {weights} [{status}]")


def add_parser(sub: argparse._SubParsersAction) -> None:
    for what in ("presets", "models", "rewards"):
        lp = sub.add_parser(what, help=f"list {what}" + (" (`models quantized`: what each precision policy "
                                                          "quantizes)" if what == "models" else ""))
        lp.add_argument("action", nargs="?", default="list", choices=["list", "quantized"] if what == "models"
                        else ["list"])
        if what == "models":
            lp.add_argument("--model", action="append",
                            help="quantized: a registered model (repeat; default: shapes and the three real models, "
                                 "whose architectures are counted without weights)")
            lp.add_argument("--path", default=None, help="quantized: the model's local weights directory")
            lp.add_argument("--backend", default="nvfp4-emu", help="quantized: the explorer backend (default nvfp4-emu)")
            lp.add_argument("--policy", action="append", help="quantized: a policy (repeat; default all)")
        lp.set_defaults(fn=cmd_list, what=what)

