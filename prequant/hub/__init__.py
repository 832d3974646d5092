"""The Hugging Face Hub through huggingface_hub: the API calls, each retried while it fails transiently (`client`);
prequant's own transfer of a weight file's body (`transfer`); the cache, its settings read from the environment at
each call, and what prequant does to it (`cache`); every failure worded as one line (`failures`); uploads
(`upload`)."""
