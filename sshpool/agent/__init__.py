"""Agent mode: one resident executor per pooled connection runs its commands (docs/pool.md).

* `executor.py`: the program sent to the host's python3 (3.6+, standard library only). It is
  read as data by the client and never imported by sshpool.
* `client.py`: `start_agent` and `AgentConnection`, a `Connection` over the executor's channel.

This package imports the sshpool core (`backends.base`, `command`, `errors`), nothing of
the pool (`sshpool.pool`, `host`, `connect`) nor the dev rig.
"""

from sshpool.agent.client import AgentConnection, start_agent

__all__ = ["AgentConnection", "start_agent"]
