"""The Hugging Face Hub through huggingface_hub: resolve a repo to a commit, download, read byte ranges, evict and
upload (`client`); downloads in a child process (`fetcher`); the cache and the settings read from the environment
at each call (`cache`); every failure worded as one line (`failures`)."""
