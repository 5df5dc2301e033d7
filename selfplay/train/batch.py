"""Training rows -> verl batches: reading and checking the parquet, padding (the advantages are
the reward seam's, ``selfplay.reward.advantage``).

Pure functions over pyarrow tables and CPU tensors (no workers, no devices), so each piece is
unit-testable. The tensor layout is verl's ``update_actor`` contract:

- ``prompts`` [B, P] left-padded (at least one real token per row), ``responses`` [B, R]
  right-padded, ``input_ids = cat(prompts, responses)``, ``attention_mask`` [B, P+R],
  ``position_ids = cumsum(attention_mask) - 1`` (0 on padding);
- ``response_mask`` [B, R]: 1 only on the trained seat's own generated tokens; partner and
  environment tokens inside the response are 0 and stay visible as context through the
  attention mask;
- ``token_level_rewards`` [B, R]: the row's scalar reward on its last mask-1 token, 0 elsewhere;
- ``rollout_log_probs`` [B, R]: the generator's log-probs, 0 where the mask is 0;
- ``off_policy`` [B, R] (only when some row is a guide's): 1 on a guide row's mask-1 tokens.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from selfplay.errors import UserError
from selfplay.reward import turn_spans
from selfplay.training_schema import TRAINING_SCHEMA, TRAINING_SCHEMA_VERSION

log = logging.getLogger(__name__)

# the columns training reads; the readable and verl-style columns are carried but not needed
REQUIRED_COLUMNS = (
    "group_id",
    "prompt_ids",
    "response_ids",
    "response_mask",
    "rollout_logprobs",
    "reward",
    "tokenizer_fingerprint",
)
# absent in files written before guided groups (off_policy), the sampling temperature or turn
# credit (turn_states)
OPTIONAL_COLUMNS = ("off_policy", "temperature", "turn_states")


class TrainDataError(UserError, ValueError):
    """Training rows that cannot be trained on; the message says what is wrong and what to do."""


def read_rows(path: str | Path) -> pa.Table:
    """Read a train.parquet and check it against ``TRAINING_SCHEMA``; raise ``TrainDataError``."""
    path = Path(path)
    if not path.exists():
        raise TrainDataError(f"{path} does not exist; write it with `selfplay convert`")
    try:
        schema = pq.read_schema(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise TrainDataError(f"{path} is not a readable parquet file ({e})") from e
    version = (schema.metadata or {}).get(b"selfplay_schema_version")
    if version is not None and version.decode() != str(TRAINING_SCHEMA_VERSION):
        raise TrainDataError(
            f"{path} has training-row schema version {version.decode()}, this selfplay reads "
            f"{TRAINING_SCHEMA_VERSION}; re-run `selfplay convert` with this version"
        )
    problems = []
    for name in REQUIRED_COLUMNS:
        expected = TRAINING_SCHEMA.field(name).type
        if name not in schema.names:
            problems.append(f"missing column {name!r} ({expected})")
        elif not _same_type(schema.field(name).type, expected):
            problems.append(f"column {name!r} is {schema.field(name).type}, expected {expected}")
    if problems:
        raise TrainDataError(
            f"{path} does not match the training-row schema: {'; '.join(problems)}. "
            "Write it with `selfplay convert` (selfplay.records.TRAINING_SCHEMA)"
        )
    optional = [name for name in OPTIONAL_COLUMNS if name in schema.names]
    table = pq.read_table(path, columns=[*REQUIRED_COLUMNS, *optional])
    if table.num_rows == 0:
        raise TrainDataError(f"{path} has no rows; generate more games and convert them again")
    return table


def _same_type(a: pa.DataType, b: pa.DataType) -> bool:
    """Type equality that ignores list item names (parquet writers call them item or element)."""
    if pa.types.is_list(a) and pa.types.is_list(b):
        return _same_type(a.value_type, b.value_type)
    return a.equals(b)


def check_tokenizer(table: pa.Table, fingerprint: str, model: str) -> None:
    """Refuse rows made with another tokenizer than ``model``'s (fingerprints must all match)."""
    found = set(table.column("tokenizer_fingerprint").to_pylist())
    if None in found:
        raise TrainDataError(
            "some rows have no tokenizer_fingerprint, so their token ids cannot be checked "
            f"against {model}; re-run `selfplay convert` on games recorded with token fingerprints"
        )
    if found != {fingerprint}:
        raise TrainDataError(
            f"the rows were tokenized with tokenizer {sorted(found)} but {model} has tokenizer "
            f"{fingerprint}; train the model that generated the games (or regenerate them with "
            "this model)"
        )


def check_token_ids(table: pa.Table, vocab_size: int, path: str | Path, model: str) -> None:
    """Refuse token ids outside ``[0, vocab_size)`` (a file from another model, or corrupted
    bytes), naming the file, the column and the id, before any model weights are loaded."""
    import pyarrow.compute as pc

    for name in ("prompt_ids", "response_ids"):
        ids = pc.list_flatten(table.column(name))
        if len(ids) == 0:
            continue
        low, high = pc.min_max(ids).values()
        if low.as_py() < 0 or high.as_py() >= vocab_size:
            bad = low.as_py() if low.as_py() < 0 else high.as_py()
            raise TrainDataError(
                f"{path}: column {name} holds token id {bad}, outside the vocabulary of {model} "
                f"(0 to {vocab_size - 1}); the file was written for another model or is "
                "corrupt: convert the games again, with the model that played them"
            )


@dataclass(frozen=True)
class Rows:
    """The training rows as Python lists, checked for internal consistency."""

    group_ids: np.ndarray  # [N] int64
    prompts: list[list[int]]
    responses: list[list[int]]
    masks: list[list[int]]
    rollout_logprobs: list[list[float]]
    rewards: np.ndarray  # [N] float32
    off_policy: np.ndarray | None = None  # [N] bool: a guide's row; None: none is
    temperature: np.ndarray | None = None  # [N] float: sampled at; NaN: unknown; None: no column
    turn_states: list[np.ndarray | None] | None = None  # per row, a state id per turn; None: none

    def __len__(self) -> int:
        return len(self.prompts)

    def select(self, idx: np.ndarray | list[int]) -> Rows:
        idx = list(map(int, idx))
        return Rows(
            group_ids=self.group_ids[idx],
            prompts=[self.prompts[i] for i in idx],
            responses=[self.responses[i] for i in idx],
            masks=[self.masks[i] for i in idx],
            rollout_logprobs=[self.rollout_logprobs[i] for i in idx],
            rewards=self.rewards[idx],
            off_policy=None if self.off_policy is None else self.off_policy[idx],
            temperature=None if self.temperature is None else self.temperature[idx],
            turn_states=None if self.turn_states is None else [self.turn_states[i] for i in idx],
        )


def rows_from_table(table: pa.Table, max_length: int | None = None, *, groups: bool = True) -> Rows:
    """Convert and check rows: aligned lengths, 0/1 masks, own tokens present, and (``groups``)
    no single-row GRPO group."""
    rows = Rows(
        group_ids=np.asarray(table.column("group_id").to_pylist(), dtype=np.int64),
        prompts=table.column("prompt_ids").to_pylist(),
        responses=table.column("response_ids").to_pylist(),
        masks=table.column("response_mask").to_pylist(),
        rollout_logprobs=table.column("rollout_logprobs").to_pylist(),
        rewards=np.asarray(table.column("reward").to_pylist(), dtype=np.float32),
        off_policy=_off_policy(table),
        temperature=_temperature(table),
        turn_states=_turn_states(table),
    )
    for i in range(len(rows)):
        p, r, m, lp = rows.prompts[i], rows.responses[i], rows.masks[i], rows.rollout_logprobs[i]
        where = f"row {i} (group {rows.group_ids[i]})"
        if not p:
            raise TrainDataError(f"{where} has an empty prompt; every row needs a prompt token")
        if not (len(r) == len(m) == len(lp)):
            raise TrainDataError(
                f"{where}: response_ids ({len(r)}), response_mask ({len(m)}) and "
                f"rollout_logprobs ({len(lp)}) must have the same length"
            )
        if any(v not in (0, 1) for v in m):
            raise TrainDataError(f"{where}: response_mask values must be 0 or 1")
        if not any(m):
            raise TrainDataError(
                f"{where} has no own (mask-1) tokens, so it cannot carry the reward; "
                "drop such rows in convert"
            )
        if not np.isfinite(rows.rewards[i]):
            raise TrainDataError(f"{where} has a non-finite reward {rows.rewards[i]}")
        states = None if rows.turn_states is None else rows.turn_states[i]
        if states is not None and len(states) != len(turn_spans(m)):
            raise TrainDataError(
                f"{where} has {len(states)} turn_states but {len(turn_spans(m))} own turns "
                "(runs of mask-1 tokens); convert the games again"
            )
        if max_length is not None and len(p) + len(r) > max_length:
            raise TrainDataError(
                f"{where} is {len(p) + len(r)} tokens long, over max_length {max_length}; "
                "raise --max-length or generate shorter games"
            )
    _, counts = np.unique(rows.group_ids, return_counts=True)
    if groups and (counts == 1).any():
        singles = np.unique(rows.group_ids)[counts == 1][:5].tolist()
        raise TrainDataError(
            f"{int((counts == 1).sum())} GRPO groups have a single row (e.g. group ids {singles}); "
            "a lone row's advantage would be its raw reward. Group rows of several games of the "
            "same scenario in convert"
        )
    return rows


def _off_policy(table: pa.Table) -> np.ndarray | None:
    """The rows' guide flags (None when the file has no guide row or predates the column)."""
    if "off_policy" not in table.column_names:
        return None
    flags = np.asarray(table.column("off_policy").fill_null(False).to_pylist(), dtype=bool)
    return flags if flags.any() else None


def _temperature(table: pa.Table) -> np.ndarray | None:
    """Each row's sampling temperature, NaN where unknown (None when the file has no column)."""
    if "temperature" not in table.column_names:
        return None
    values = table.column("temperature").to_pylist()
    return np.asarray([np.nan if t is None else t for t in values], dtype=np.float64)


def _turn_states(table: pa.Table) -> list[np.ndarray | None] | None:
    """Each row's turn state ids (written by convert --credit turn; None when no row has them)."""
    if "turn_states" not in table.column_names or table.column("turn_states").null_count == len(
        table
    ):
        return None
    values = table.column("turn_states").to_pylist()
    return [None if v is None else np.asarray(v, dtype=np.int64) for v in values]


def full_sequence_mask(prompts: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """The response mask placed over the whole padded sequence [B, P+R]: 0 on the prompt."""
    return torch.cat([torch.zeros_like(prompts), response_mask], dim=1)


def collate(rows: Rows, pad_id: int) -> dict[str, torch.Tensor]:
    """Pad rows into verl's tensor layout (see the module docstring)."""
    b = len(rows)
    p_len = max(len(p) for p in rows.prompts)
    r_len = max(len(r) for r in rows.responses)
    prompts = torch.full((b, p_len), pad_id, dtype=torch.long)
    responses = torch.full((b, r_len), pad_id, dtype=torch.long)
    attention = torch.zeros((b, p_len + r_len), dtype=torch.long)
    response_mask = torch.zeros((b, r_len), dtype=torch.long)
    rollout_lp = torch.zeros((b, r_len), dtype=torch.float32)
    rewards = torch.zeros((b, r_len), dtype=torch.float32)
    for i in range(b):
        p, r = rows.prompts[i], rows.responses[i]
        prompts[i, p_len - len(p) :] = torch.tensor(p)
        attention[i, p_len - len(p) : p_len] = 1
        if r:
            responses[i, : len(r)] = torch.tensor(r)
            attention[i, p_len : p_len + len(r)] = 1
            mask = torch.tensor(rows.masks[i], dtype=torch.long)
            response_mask[i, : len(r)] = mask
            rollout_lp[i, : len(r)] = torch.tensor(rows.rollout_logprobs[i]) * mask
            last_own = int(torch.nonzero(mask)[-1])
            rewards[i, last_own] = float(rows.rewards[i])
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    batch = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention,
        "position_ids": position_ids,
        "response_mask": response_mask,
        "rollout_log_probs": rollout_lp,
        "token_level_rewards": rewards,
    }
    if rows.off_policy is not None:
        flags = torch.from_numpy(rows.off_policy.astype(np.float32))[:, None]
        batch["off_policy"] = flags * response_mask.float()
    return batch


def to_tensordict(tensors: dict[str, torch.Tensor], temperature: float = 1.0, **non_tensors):
    """Tensors in verl's padded layout -> the no-padding TensorDict its workers take; verl scores
    log-softmax(logits / ``temperature``)."""
    from verl import DataProto
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    proto = DataProto.from_dict(tensors=dict(tensors), meta_info={"temperature": temperature})
    td = left_right_2_no_padding(proto.to_tensordict())
    tu.assign_non_tensor(td, **non_tensors)
    return td


def from_nested(values, td) -> torch.Tensor:
    """A nested per-token output of a worker -> a padded [B, R] float tensor."""
    from verl.workers.utils.padding import no_padding_2_padding

    return no_padding_2_padding(values, td).float()
