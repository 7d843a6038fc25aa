"""The trainer service: the driver of the distributed loop behind gRPC Status, health and the ops app."""
