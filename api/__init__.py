"""The HTTP API in front of `sshpool`: FastAPI app (`app.py`), the long-lived objects
(`services.py`), the process model (`workers.py`), routes (`routes/`), admission (`policy.py`:
`Policy.admit`), running jobs (`jobs/`: commands, batch jobs and the Slurm client; a batch
request's shape in `batchspec.py`), the store, auth, how hosts log in (`credentials.py`: key
files or certificates), administration (`admin/`: revocations, login-node drains, host
details), the error -> HTTP mapping (`problems.py`), the job-state vocabulary (`states.py`),
output types (`output.py`), the local development wiring (`local.py`, also the light seam the
load suite uses for tokens), and the researcher's client (`client/`: its commands too; it
imports nothing of the rest, the rest may use it).

May import: `sshpool` by its public names. Never the dev rig `sshpool.devhost`, except the
`sshapi dev` command, which imports it inside the command.
"""
