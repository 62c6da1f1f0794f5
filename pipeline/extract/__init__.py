"""The hidden-state extraction stage: `eagle3 extract` and `eagle3 verify`."""
