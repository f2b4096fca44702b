"""One storage layer (local + S3) and what is stored: hive logs, the label store, anchors, publications."""
