"""eagle3-ops handlers package."""
