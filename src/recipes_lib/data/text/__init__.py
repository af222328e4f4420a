"""Pretraining text: raw documents tokenized once into cached shards, read as packed windows.

``raw`` loads a source's documents, ``prepare`` trains or finds the tokenizer and fills
the cache through ``shard_writer`` (``shards`` reads what it wrote), ``packing`` cuts a
shard into ``seq_len`` windows, and ``module`` is ``PretrainDataModule``.
"""
