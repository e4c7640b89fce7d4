"""Jobs: commands and batch jobs run on the hosts through the pool.

| module         | what                                                              |
|----------------|-------------------------------------------------------------------|
| `service.py`   | `JobService`, the face for the routes: admission, the insert, the |
|                | hand-off to the runner; reads, waits, cancels, output and live    |
|                | feeds by id (the feeds are api/live/'s)                           |
| `runner.py`    | one job's life on the pool: run, record the outcome, give the     |
|                | place under the cap back                                          |
| `cancel.py`    | cancel a command here or on another replica, or a batch job       |
| `batch.py`     | `BatchJobs`: sbatch, trackers, scancel, output files of batch jobs|
| `scheduler.py` | the Slurm client (`SlurmClient`, `Tracker`)                       |

Exports `JobService` and `BatchJobs`, what api/services.py builds and the routes call; no module
of api/ outside this package imports its modules (the Slurm client included: a batch request's
shape is api/batchspec.py's), which tests/test_layout.py checks.

May import: api's shared modules (auth, batchspec, config, live, metrics, output, policy,
problems, quota, schemas, states, store, tasks, timing) and `sshpool` by its public names;
never the routes, api/services.py, api/app.py or api/deps.py.
"""

from api.jobs.batch import BatchJobs
from api.jobs.service import JobService

__all__ = ["BatchJobs", "JobService"]
