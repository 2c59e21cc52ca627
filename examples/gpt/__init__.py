"""The pieces of ``examples/train_gpt.py``: the model, the resumable data, and the training state."""
