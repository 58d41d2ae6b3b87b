"""Data path: records -> tokenized SFT samples with a loss mask -> token-budget micro-batches -> packed batches."""

from __future__ import annotations

from laden.data.batch import IGNORE_INDEX, PackedBatch, pack_samples, unpack
from laden.data.loader import GlobalBatchIterator, longest_first
from laden.data.packing import PACKING_ALGORITHMS, ffd_partition, kk_partition, partition_microbatches
from laden.data.rows import check_prompt_rows, check_sft_rows
from laden.data.sft import LengthStats, Sample, build_sft_samples, sample_lengths, tokenize_sft_record
from laden.data.sources import HubOptions, Records, load_records, read_dataset

__all__ = [
    "IGNORE_INDEX",
    "PACKING_ALGORITHMS",
    "GlobalBatchIterator",
    "HubOptions",
    "longest_first",
    "LengthStats",
    "PackedBatch",
    "Records",
    "Sample",
    "build_sft_samples",
    "check_prompt_rows",
    "check_sft_rows",
    "ffd_partition",
    "kk_partition",
    "load_records",
    "pack_samples",
    "partition_microbatches",
    "read_dataset",
    "sample_lengths",
    "tokenize_sft_record",
    "unpack",
]
