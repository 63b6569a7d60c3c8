"""The processor: one consumer group on the commands topic, one StreamTask per partition."""
