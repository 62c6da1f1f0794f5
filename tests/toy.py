"""The toy server launcher lives in the package (bench/ uses it too); tests import it from here."""

from pipeline.toy.launch import ROOT, ToyServer, write_dataset  # noqa: F401
