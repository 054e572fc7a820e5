"""Data for bigtrain: text (datasets + tokenizer), classification, images, synthetic.

    bundle = build_data("builtin", "text", seq_len=256, tokenizer_dir=out / "tokenizer",
                        cache_dir=out / "data_cache", is_writer=rank == 0, barrier=dist.barrier)
    sampler = ResumableSampler(len(bundle.train), dp_rank, dp_size, seed)
    for batch in batches(bundle.train, sampler, micro_batch): ...   # checkpoint sampler.state_dict()
"""
from bigtrain.data.build import MODALITIES, build_data
from bigtrain.data.dataset import ArrayDataset, Batch, DataBundle, IndexedDataset, split_rows
from bigtrain.data.loader import batches, eval_batch_count, iter_eval_batches
from bigtrain.data.sampler import ResumableSampler
from bigtrain.data.tokenizer import ensure_tokenizer, load_tokenizer

__all__ = [
    "MODALITIES", "ArrayDataset", "Batch", "DataBundle", "IndexedDataset", "ResumableSampler", "batches",
    "build_data", "ensure_tokenizer", "eval_batch_count", "iter_eval_batches", "load_tokenizer", "split_rows",
]
