"""Preference pairs (DPO): a prompt with a chosen and a rejected response, rendered as chats.

``pairs`` validates, tokenizes and truncates records, ``collate`` batches pairs (packed
or padded), ``module`` is ``PreferenceDataModule``, and ``stdlib_pairs`` is the built-in
``stdlib_dpo`` source.
"""
