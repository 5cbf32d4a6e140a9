"""The gRPC front door: admission, tokenization, routing policies, token streaming, client."""
