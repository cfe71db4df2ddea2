"""Speculative decoding: drafters that propose tokens for the target model to verify."""
