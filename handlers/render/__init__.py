"""The wording: every message a person reads, as terminal text and as Block Kit (listeners and the notifier render through these)."""
