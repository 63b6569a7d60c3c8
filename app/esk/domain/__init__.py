"""The domain layer: what an aggregate type is, and given/when/then for testing one.

Pure code: it imports nothing else of esk, and no Kafka, HTTP or storage.
"""
