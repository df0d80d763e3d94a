"""Publishing a policy to every engine replica (`POST /policy`), and keeping turns off any
replica that does not serve it: `state.py` (the published policy, as stored), `checkpoint.py`
(a checkpoint checked against the served model before any engine is touched), `control.py`
(what is said to one engine replica), `fleet.py` (the fan-out, fencing and catch-up)."""
