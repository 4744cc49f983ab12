"""The model: the decoder, its configuration and loading, compiled and packed layers."""
