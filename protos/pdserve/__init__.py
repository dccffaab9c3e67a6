"""Generated code of the pdserve.* proto packages."""
