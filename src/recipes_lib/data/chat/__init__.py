"""Chat (SFT): conversations rendered with a chat template, trained on the assistant's turns.

``messages`` validates a record's turns, ``template`` renders them to tokens and an
assistant mask, ``examples`` makes records into labelled examples, ``packing`` puts
examples into rows, ``module`` is ``ChatDataModule``, and ``instructions`` is the
built-in ``stdlib_sft`` source.
"""
