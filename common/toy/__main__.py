"""python -m common.toy: write a world, or print the baselines of one."""

from common.toy import main

main()
