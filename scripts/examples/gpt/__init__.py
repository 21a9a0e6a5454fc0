"""The tiny GPT of ``scripts.examples.train_gpt``: options, model and data, the training paths, the pretrain loop."""
