"""slime's custom generate function (`--custom-generate-function-path`, `async def
generate(args, sample, sampling_params) -> Sample`; read from slime's `slime/utils/types.py`,
which is not on PyPI): a rollout run through a session URL, written into slime's `Sample`.

A `Sample` holds the whole sequence in `tokens`, the response's length in `response_length`,
and `loss_mask` and `rollout_log_probs` over the response only; `weight_versions` gets one
entry per generate call (slime appends each SGLang response's `weight_version`), `status` is a
`Sample.Status`. Checked against slime's own `Sample` (commit 624b824) in
bench/results/adapters.md. This module imports nothing
from slime: it sets those attributes on the sample slime passed in.

    async def generate(args, sample, sampling_params):
        ...  # a session per sample: run the agent at its URL, finish it with a reward
        [row] = [r async for r in tk.export(session_ids=[session.id])]
        return fill_sample(sample, row)
"""

from __future__ import annotations

from typing import Any, TypeVar

from tokenkeep.integrations._rows import split
from tokenkeep.types import Row

S = TypeVar("S")

STATUS = {"ok": "COMPLETED", "aborted": "ABORTED", "env_error": "FAILED", "model_error": "FAILED"}
"""tokenkeep's finish status -> the name of slime's `Sample.Status` member."""


def fill_sample(sample: S, row: Row) -> S:
    """Writes one exported row (a segment of a finished session) into slime's `sample`:
    `tokens` = the whole segment, `response_length` = the tokens from the first sampled one,
    `loss_mask` and `rollout_log_probs` (0.0 on context) over them, `weight_versions` = the
    version of each sampled span in order (as slime appends one per generate call: two turns
    on one version give it twice), `reward`, `status` from the finish status, `session_id`."""
    part = split(row)
    target: Any = sample
    target.tokens = list(row.token_ids)
    target.response_length = len(part.response_ids)
    target.loss_mask = part.response_mask
    target.rollout_log_probs = part.response_logprobs
    target.weight_versions = [span.version for span in row.weight_versions]
    target.reward = row.reward
    target.status = type(target).Status[STATUS[row.status or "ok"]]
    target.session_id = row.session_id
    return sample
