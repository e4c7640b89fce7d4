"""The job store's revisions, oldest first: one schema change a file, never edited once released."""
