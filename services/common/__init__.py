"""Plumbing shared by the service shells (import the modules directly).

tensors      solrl.common.v1.Tensor <-> numpy / torch with input checks
kserve       KServe v2 / Triton inference-protocol tensors <-> numpy
errors       service errors and the exception -> gRPC status table
grpc_server  build_grpc_server: error interceptor, metrics, grpc.health.v1, reflection, Triton's size limits
batching     DynamicBatcher: concurrent requests share one batched call
metrics      ServiceMetrics: a Prometheus registry per service
ops          create_ops_app (/healthz, /readyz, /metrics, /v1/info) and HttpServer
env          Addresses.from_env: SOLRL_BIND_HOST, SOLRL_GRPC_PORT, SOLRL_HTTP_PORT; every SOLRL_* name read
args         the options the roles share (light: each role's parser is services/<role>/args.py, so
             `solrl serve ROLE --help` needs no grpc / torch)
"""
