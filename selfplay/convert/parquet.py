"""Rows to Arrow and parquet: batches in ``records.TRAINING_SCHEMA``, the two parquet outputs, and
the Arrow spool on disk where rows wait until their group is known to be written."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from selfplay.convert.rows import Row
from selfplay.records import TRAINING_SCHEMA

# file buffers: a game is a ~100 KB line and a spooled batch a few MB; with the default 8 KB a line
# is copied in many pieces and the spool written in thousands of small system calls
IO_BUFFER = 1 << 20
SPLITS = ("train", "val")

_MESSAGES_TYPE = TRAINING_SCHEMA.field("messages").type
_REWARD_MODEL_FIELDS = list(TRAINING_SCHEMA.field("reward_model").type)
_EXTRA_INFO_FIELDS = list(TRAINING_SCHEMA.field("extra_info").type)
_DICT_COLUMNS = ["group_key", "scenario_id", "tokenizer_fingerprint", "data_source"]


def _list_array(
    chunks: list[np.ndarray], lengths: np.ndarray, dtype: type, arrow_type: pa.DataType
) -> pa.Array:
    """One list array of the rows' token arrays. The values are copied into a buffer of Arrow's
    memory pool, which keeps its pages between batches: a bytes object of over a MB for every
    batch (b"".join) was mapped fresh from the kernel each time, at a page fault per 4 KB."""
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    buf = pa.allocate_buffer(int(offsets[-1]) * np.dtype(dtype).itemsize)
    np.concatenate(chunks, out=np.frombuffer(buf, dtype=dtype))
    values = pa.Array.from_buffers(arrow_type.value_type, int(offsets[-1]), [None, buf])
    return pa.ListArray.from_arrays(pa.array(offsets), values, type=arrow_type)


def to_batch(rows: list[tuple[Row, int]], data_source: str) -> pa.RecordBatch:
    """(row, group id) pairs -> one batch in TRAINING_SCHEMA, from flat buffers."""
    f = TRAINING_SCHEMA.field
    n = len(rows)
    n_prompt = np.fromiter((len(r.prompt_ids) for r, _ in rows), np.int64, n)
    n_response = np.fromiter((len(r.response_ids) for r, _ in rows), np.int64, n)
    gid = pa.array([g for _, g in rows], pa.int64())
    game_id = pa.array([r.game_id for r, _ in rows], pa.string())
    seat = pa.array([r.seat for r, _ in rows], pa.int8())
    reward = pa.array([r.reward for r, _ in rows], pa.float32())
    messages = pa.array([r.messages for r, _ in rows], type=_MESSAGES_TYPE)
    columns = {
        "group_id": gid,
        "group_key": pa.array([r.group_key for r, _ in rows], pa.string()),
        "game_id": game_id,
        "scenario_id": pa.array([r.scenario_id for r, _ in rows], pa.string()),
        "seat": seat,
        "round": pa.array([r.round for r, _ in rows], pa.int32()),
        "prompt_ids": _list_array(
            [r.prompt_ids for r, _ in rows], n_prompt, np.int32, f("prompt_ids").type
        ),
        "response_ids": _list_array(
            [r.response_ids for r, _ in rows], n_response, np.int32, f("response_ids").type
        ),
        "response_mask": _list_array(
            [r.response_mask for r, _ in rows], n_response, np.int8, f("response_mask").type
        ),
        "rollout_logprobs": _list_array(
            [r.rollout_logprobs for r, _ in rows],
            n_response,
            np.float32,
            f("rollout_logprobs").type,
        ),
        "reward": reward,
        "off_policy": pa.array([r.off_policy for r, _ in rows], pa.bool_()),
        "temperature": pa.array([r.temperature for r, _ in rows], pa.float32()),
        "turn_states": pa.array(
            [r.turn_states for r, _ in rows], TRAINING_SCHEMA.field("turn_states").type
        ),
        "tokenizer_fingerprint": pa.array([r.tokenizer_fingerprint for r, _ in rows], pa.string()),
        "messages": messages,
        "data_source": pa.repeat(pa.scalar(data_source, pa.string()), n),
        # converted again rather than cut from `messages`: a take is slower for a few messages
        "prompt": pa.array(
            [r.messages[: r.n_prompt_messages] for r, _ in rows], type=_MESSAGES_TYPE
        ),
        "reward_model": pa.StructArray.from_arrays(
            [pa.repeat(pa.scalar("rule", pa.string()), n), reward], fields=_REWARD_MODEL_FIELDS
        ),
        "extra_info": pa.StructArray.from_arrays([gid, game_id, seat], fields=_EXTRA_INFO_FIELDS),
    }
    return pa.RecordBatch.from_arrays(
        [columns[f.name] for f in TRAINING_SCHEMA], schema=TRAINING_SCHEMA
    )


class Writers:
    """The two parquet outputs and the two spools, each fed in batches of rows. ``paths`` names
    the files: "train", "val", "spool_train", "spool_val"; ``on_write`` sees every batch that
    goes to a parquet output."""

    def __init__(
        self,
        paths: dict[str, Path],
        *,
        batch_rows: int,
        compression: str,
        data_source: str,
        on_write: Callable[[pa.RecordBatch], None],
    ) -> None:
        self.batch_rows, self.data_source, self.on_write = batch_rows, data_source, on_write
        self.rows = {"train": 0, "val": 0}
        self.pending: dict[tuple[str, str], list[tuple[Row, int]]] = {}
        self.parquet: dict[str, pq.ParquetWriter] = {}
        self.spools: dict[str, pa.ipc.RecordBatchStreamWriter] = {}
        self._files: list[pa.NativeFile] = []
        for split in SPLITS:
            self.parquet[split] = pq.ParquetWriter(
                str(paths[split]),
                TRAINING_SCHEMA,
                compression=compression,
                # dictionary encoding of token lists costs 4x the write time for nothing
                use_dictionary=_DICT_COLUMNS,
                write_statistics=False,  # min/max of token lists help no reader and cost 20%
            )
            # buffered: the IPC writer issues a write call for every buffer of a batch
            sink = pa.output_stream(str(paths[f"spool_{split}"]), buffer_size=IO_BUFFER)
            self._files.append(sink)
            self.spools[split] = pa.ipc.new_stream(sink, TRAINING_SCHEMA)
            for dest in ("out", "spool"):
                self.pending[(split, dest)] = []

    def add(self, split: str, dest: str, row: Row, gid: int) -> None:
        """Queue a row for the parquet output (dest "out") or the spool (dest "spool")."""
        pending = self.pending[(split, dest)]
        pending.append((row, gid))
        if len(pending) >= self.batch_rows:
            self.flush(split, dest)

    def flush(self, split: str, dest: str) -> None:
        rows = self.pending[(split, dest)]
        if not rows:
            return
        batch = to_batch(rows, self.data_source)
        rows.clear()
        if dest == "out":
            self.write(split, batch)
        else:
            self.spools[split].write_batch(batch)

    def write(self, split: str, batch: pa.RecordBatch) -> None:
        self.on_write(batch)
        self.parquet[split].write_batch(batch)
        self.rows[split] += batch.num_rows

    def close_spools(self) -> None:
        for key in self.pending:
            self.flush(*key)
        for spool in self.spools.values():
            spool.close()
        for f in self._files:
            f.close()
        self._files = []

    def close(self) -> None:
        for f in self._files:
            f.close()
        for w in self.parquet.values():
            w.close()


def copy_spool(path: Path, split: str, kept: pa.Array, out: Writers) -> None:
    """Pass 2: the spooled rows of groups that turned out to be kept go to the output."""
    with pa.input_stream(str(path), buffer_size=IO_BUFFER) as source:
        for batch in pa.ipc.open_stream(source):
            batch = batch.filter(pc.is_in(batch["group_id"], value_set=kept))
            if batch.num_rows:
                out.write(split, batch)
