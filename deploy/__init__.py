"""The `pdserve` command line, the embedded one-machine launcher, images and cluster config."""
