"""The EAGLE-3 draft-head trainer (`python -m pipeline.train`, run under torchrun)."""
