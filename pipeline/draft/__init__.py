"""The draft as SGLang reads and runs it: its loading rules checked, its acceptance length measured."""
