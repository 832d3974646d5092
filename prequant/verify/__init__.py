"""`prequant verify` and `prequant upload`: reopen an output and prove it is what prequant wrote (`run.verify`:
`files`, `tensors`, `compare` each file what they find in a `report.Report`), and publish it only then
(`publish`)."""
