"""Soak: real processes under churn, faults and hostile traffic (see kvfabric._tools.soak).

python benchmarks/soak.py                               # 2 minutes, 40 fault rounds
python benchmarks/soak.py --minutes 20 --fuzz 100000    # the long run (>= 1 M key ops)
"""

from kvfabric._tools.soak import main

if __name__ == "__main__":
    main()
