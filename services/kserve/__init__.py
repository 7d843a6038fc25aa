"""The KServe v2 / Triton front door shared by the reward and explorer services: one gRPC servicer
(`grpc.InferenceServicer`), the REST door that transcodes into it (`http.mount_kserve_http`), the tensor codec
and model descriptors (`tensors`) and Triton's statistics (`stats`). Server plumbing is services/common's, what
the rollout roles share services/rollout's."""
