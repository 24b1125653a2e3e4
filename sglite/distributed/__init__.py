"""Tensor parallelism's process groups and collectives (SGLang: distributed/)."""
