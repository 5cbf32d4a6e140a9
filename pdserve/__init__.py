"""pdserve: every package of the repository's top-level folders, installed under
one name (docs/architecture.md, "One namespace")."""
