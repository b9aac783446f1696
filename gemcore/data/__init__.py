"""Data: jagged datasets and batches, the synthetic source, users' files, batch samplers."""
from gemcore.data.bbs import BaseBatchShuffler
from gemcore.data.dataset import JaggedBatch, JaggedDataset
from gemcore.data.loader import load_user_data
from gemcore.data.samplers import RandomBatchSampler
from gemcore.data.synthetic import make_synthetic
from gemcore.data.workloads import history_lengths

__all__ = ["BaseBatchShuffler", "JaggedBatch", "JaggedDataset", "RandomBatchSampler", "history_lengths",
           "load_user_data", "make_synthetic"]
