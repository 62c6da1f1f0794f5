"""The auto-start handoff: verified completion of extraction, then the server stopped, then training."""
