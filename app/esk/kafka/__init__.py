"""Kafka plumbing: client options, topic layout and administration."""
