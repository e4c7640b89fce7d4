"""Administration: revocations, login-node drains and node state, host details.

| module           | what                                                                 |
|------------------|----------------------------------------------------------------------|
| `service.py`     | `AdminService`, the face for the routes (api/routes/admin.py,        |
|                  | nodes.py, hosts.py): revoke, list and lift; drain and undrain a      |
|                  | login node; the hosts a caller may use, their health and pools       |
| `revocations.py` | `Revocations`: the revocations as this replica knows them, what      |
|                  | revoking does here (kill, close), the poll and the Redis nudge       |
| `nodes.py`       | `NodeDrains`: the drained login nodes applied to this replica's pool |

Exports `AdminService` and what api/services.py builds it from (`Revocations`, `RedisNudge`,
`NodeDrains`); the auth gate (api/deps.py) and the live routes ask `Revocations` whether a
caller is refused. The routes reach the store, the pool and the policy only through the
service, which tests/test_layout.py checks.

May import: api's shared modules (auth, config, policy, problems, pubsub, quota, schemas,
store) and `sshpool` by its public names; never the routes, api/services.py, api/app.py or
api/deps.py.
"""

from api.admin.nodes import NodeDrains
from api.admin.revocations import RedisNudge, Revocations
from api.admin.service import AdminService

__all__ = ["AdminService", "NodeDrains", "RedisNudge", "Revocations"]
