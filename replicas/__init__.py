"""Replicas: the registry of upstream SGLang servers, their lifecycle, health and load.

`model` holds the values policies read (`ReplicaView`); `registry` owns the state
machine, health probes and load accounting; `discovery` finds replicas (static list,
DNS, Kubernetes EndpointSlices); `sglang_args` generates SGLang launch commands.
This package may use HTTP (probes) but never imports `gateway` or `policies`.
"""
