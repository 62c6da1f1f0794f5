"""Stand-ins: the toy target and server, the trace simulator, the ETA scoring, the demo workspace."""
