-- Validates the constraints of the previous migration. In a transaction of its own, VALIDATE
-- takes a SHARE UPDATE EXCLUSIVE lock: rides stay readable and writable while it scans them.
-- Every row the previous migration found has both columns NULL, so nothing can fail here.

SET LOCAL lock_timeout = '5s';

ALTER TABLE rides VALIDATE CONSTRAINT rides_charge_doubt_check;
ALTER TABLE rides VALIDATE CONSTRAINT rides_charge_doubt_shape;
