"""eagle3-ops bot package."""
