"""Where the weights come from: resolve SOURCE (a local directory, `org/name[@revision]` on the Hub, or an alias)
into a `Source`, list its tensors, and stream their data (`resolve`, the entry point; `spec`, what each kind of
SOURCE is; `remote_headers` plans a Hub source from its shards' headers before they are downloaded, and
`hub_stream` downloads them as the conversion reaches them).

This face and `spec` are standard library only at import: the CLI lists a local source before torch loads."""
