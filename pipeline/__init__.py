"""eagle3-ops pipeline package."""
