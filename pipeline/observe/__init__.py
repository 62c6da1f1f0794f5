"""Observation: probes, the sampler, diagnosis, the ETA and verdicts (the spine)."""
