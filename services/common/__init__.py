"""Server plumbing any role uses (import the modules directly); it imports no role, and nothing of
services/rollout (what the explorer and regenerator share) or services/kserve (the KServe door).

tensors          solrl.common.v1.Tensor <-> numpy / torch with input checks
errors           service errors and the exception -> gRPC status table
grpc_server      build_grpc_server: error interceptor, metrics, grpc.health.v1, reflection, Triton's size limits
batching         DynamicBatcher: concurrent requests share one batched call
bodies           request bodies read with a bound (size, gzip / deflate, deadline)
auth             the data planes' bearer token: gRPC interceptor, REST middleware, client metadata
metrics          ServiceMetrics: a Prometheus registry per service
ops              create_ops_app (/healthz, /readyz, /metrics, /v1/info) and HttpServer
lifecycle        RunningService, run_main, serve_until_stopped: start, signals, shutdown
logs             the service processes' logging
env              Addresses.from_env: SOLRL_BIND_HOST, SOLRL_GRPC_PORT, SOLRL_HTTP_PORT; every SOLRL_* name read
args             the options the roles share (light: each role's parser is services/<role>/args.py, so
                 `solrl serve ROLE --help` needs no grpc / torch)
adapter_headers  the headers an adapter travels with (the trainer serves them, the rollout roles read them)
"""
