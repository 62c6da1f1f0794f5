"""Flags of `eagle3 toy-server`, kept free of torch so the CLI starts fast."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The toy server's flags (shared with `eagle3 toy-server`)."""
    p.add_argument("--port", type=int, default=30000, help="port on 127.0.0.1 (0: any free port, printed)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--stock", action="store_true", help="behave like stock SGLang with aux capture: 3 aux layers, no final")
    p.add_argument("--chunked-prefill-size", type=int, default=8192)
    p.add_argument("--radix-cache", action="store_true", help="report the radix cache as enabled")
    p.add_argument("--dump-dir", help="dump mode: write each sample's tensors here and name the file in the response")
    p.add_argument("--dump-field", default="hidden_states_path")
    p.add_argument("--latency-ms", type=float, default=0.0)
    p.add_argument("--error-rate", type=float, default=0.0)
    p.add_argument("--hang-after", type=int, default=0, help="hang every /generate after N requests")
    p.add_argument("--hang-for", type=float, default=0.0, metavar="S",
                   help="with --hang-after: the hang ends S seconds after it began (a server that wedges, then "
                        "recovers by itself); 0: for ever")
    p.add_argument("--crash-after", type=int, default=0, help="exit abruptly on request N+1")
    p.add_argument("--wrong-rows-every", type=int, default=0, help="drop one row from every Nth response")
    p.add_argument("--fixed-reply", action="store_true", help="skip the model (client benchmarks)")
    p.add_argument("--answer-tokens", type=int, default=0, metavar="N",
                   help="end every answer with its first stop token after N tokens (a target that finishes its "
                        "turns; 0: the model decides)")
    p.add_argument("--log-requests", metavar="FILE",
                   help="append each /generate request's sampling_params and input_ids to FILE as a JSON line")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--aux-layer-ids", type=lambda v: [int(x) for x in v.split(",")], metavar="A,B,C",
                   help="as SGLang's --return-aux-hidden-state-layer-ids: captured as Llama does (the inputs of layers "
                        "A+1, B+1, C+1) and reported as given; default: SGLang's [2, N//2, N-3], reported as null")
    p.add_argument("--export-target", metavar="DIR", help="write the toy target as a Hugging Face directory "
                   "(config.json; embedding, final norm and LM head through model.safetensors.index.json) and exit")
