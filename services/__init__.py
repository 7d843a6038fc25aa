"""solrl service shells: one package per role (gRPC data plane + FastAPI ops app) over the core library."""
