"""Jobs: commands and batch jobs run on the hosts through the pool (the face comes with the
split of the service)."""
