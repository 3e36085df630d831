import { indicatorView } from '../indicator';
import { CedanaModel } from '../model';
import {
  allowedActions,
  backoffText,
  badgeText,
  checkpointText,
  orphansText,
  queueText,
  suspendTitle
} from '../panel';
import { statusText } from '../statusbar';
import { EVENT_SCHEMA_ID } from '../types';
import { FakeServer, makeKernel, makeStatus } from './fakes';

describe('indicatorView', () => {
  it('says nothing for a running kernel', () => {
    expect(indicatorView(makeKernel())).toBeNull();
    expect(indicatorView(undefined)).toBeNull();
  });

  it('says Suspended with the checkpoint in the tooltip', () => {
    const view = indicatorView(
      makeKernel({ state: 'suspended', tier: 'disk', checkpoint_bytes: 1.5e9 })
    )!;
    expect(view.text).toBe('Suspended');
    expect(view.title).toContain('checkpoint 1.50 GB');
    expect(view.title).toContain('run a cell');
    expect(view.fraction).toBeNull();
  });

  it('says Resuming… (size) with progress', () => {
    const view = indicatorView(
      makeKernel({
        state: 'resuming',
        checkpoint_bytes: 4e9,
        progress: { phase: 'restore', fraction: 0.42 }
      })
    )!;
    expect(view.text).toBe('Resuming… (4.00 GB) 42 %');
    expect(view.fraction).toBeCloseTo(0.42);
    expect(view.state).toBe('resuming');
  });

  it('shows a failure with its reason', () => {
    const view = indicatorView(
      makeKernel({ state: 'failed', reason: 'bad image' })
    )!;
    expect(view.title).toBe('bad image');
  });
});

describe('checkpointText', () => {
  const GB = 1e9;
  const MB = 1e6;

  it('shows a whole image, or its size alone from older servers', () => {
    expect(checkpointText(makeKernel()).text).toBe('–');
    expect(checkpointText(makeKernel({ checkpoint_bytes: 2 * GB })).text).toBe(
      '2.00 GB'
    );
    const whole = checkpointText(
      makeKernel({
        state: 'suspended',
        checkpoint_bytes: 2 * GB,
        checkpoint_disk: {
          image_bytes: 2 * GB,
          base_bytes: 0,
          layers: 1,
          kept_base: false
        }
      })
    );
    expect(whole.text).toBe('2.00 GB');
    expect(whole.title).toContain('whole image');
  });

  it('splits an incremental image from its bases', () => {
    const view = checkpointText(
      makeKernel({
        state: 'suspended',
        checkpoint_bytes: 2 * GB + 30 * MB,
        checkpoint_disk: {
          image_bytes: 30 * MB,
          base_bytes: 2 * GB,
          layers: 3,
          kept_base: false
        }
      })
    );
    expect(view.text).toBe('30.0 MB + 2.00 GB base');
    expect(view.title).toBe(
      'An incremental image of 30.0 MB on 2 bases of 2.00 GB: 2.03 GB on disk'
    );
  });

  it("says a running kernel's image is a kept base, dropped first for room", () => {
    const view = checkpointText(
      makeKernel({
        checkpoint_bytes: 1 * GB,
        checkpoint_disk: {
          image_bytes: 1 * GB,
          base_bytes: 0,
          layers: 1,
          kept_base: true
        }
      })
    );
    expect(view.text).toBe('1.00 GB kept as base');
    expect(view.title).toContain(
      'dropped first when the checkpoint disk needs room'
    );
  });

  it('trusts a size an event changed over a split read before it', () => {
    const view = checkpointText(
      makeKernel({
        state: 'suspended',
        checkpoint_bytes: 3 * GB,
        checkpoint_disk: {
          image_bytes: 1 * GB,
          base_bytes: 0,
          layers: 1,
          kept_base: true
        }
      })
    );
    expect(view.text).toBe('3.00 GB');
  });
});

describe('panel helpers', () => {
  it('allows only what the state permits', () => {
    expect(allowedActions(makeKernel(), false)).toEqual({
      suspend: true,
      resume: false,
      keepAwake: true
    });
    expect(
      allowedActions(makeKernel({ suspendable: false }), false).suspend
    ).toBe(false);
    expect(allowedActions(makeKernel({ state: 'suspended' }), false)).toEqual({
      suspend: false,
      resume: true,
      keepAwake: false
    });
    expect(allowedActions(makeKernel({ state: 'failed' }), false).resume).toBe(
      true
    );
    expect(allowedActions(makeKernel({ state: 'resuming' }), false)).toEqual({
      suspend: false,
      resume: false,
      keepAwake: false
    });
    expect(allowedActions(makeKernel(), true)).toEqual({
      suspend: false,
      resume: false,
      keepAwake: false
    });
  });

  it('shows a queued suspend or resume and where it waits', () => {
    const queued = makeKernel({
      queued: { action: 'suspend', position: 1, since: null }
    });
    expect(badgeText(queued)).toBe('running · queued to suspend');
    expect(queueText(queued)).toBe(
      'Waiting for a free suspend slot (next in line): other kernels are being suspended.'
    );
    expect(allowedActions(queued, false).suspend).toBe(false);
    expect(allowedActions(queued, false).keepAwake).toBe(true);
    expect(suspendTitle(queued)).toContain('waits for a free slot');
    const resume = makeKernel({
      state: 'suspended',
      tier: 'disk',
      queued: { action: 'resume', position: 3, since: null }
    });
    expect(badgeText(resume)).toBe('suspended · disk · queued to resume');
    expect(queueText(resume)).toContain('#3 in line');
    expect(queueText(makeKernel())).toBeNull();
    const view = indicatorView(resume)!;
    expect(view.text).toBe('Resuming… (queued)');
    expect(view.title).toContain('#3 in line');
  });

  it('says why automatic suspend does not happen', () => {
    const reason =
      'Not checkpointable: it holds a socket connected to a process outside the kernel';
    const stuck = makeKernel({
      reason,
      backoff: {
        failures: 1,
        reason: 'External socket is used',
        not_checkpointable: true,
        retry_at: '2030-01-01T01:00:00.000Z'
      }
    });
    expect(backoffText(stuck)).toBe(reason);
    // Manual suspend still tries, and says so.
    expect(allowedActions(stuck, false).suspend).toBe(true);
    expect(suspendTitle(stuck)).toBe(
      'Not checkpointable as it is (External socket is used); Suspend tries anyway'
    );
    const failing = makeKernel({
      reason: null,
      backoff: {
        failures: 2,
        reason: 'disk full',
        not_checkpointable: false,
        retry_at: '2030-01-01T01:00:00.000Z'
      }
    });
    expect(backoffText(failing)).toBe('Automatic suspend failed: disk full');
    expect(suspendTitle(failing)).toContain('Suspend tries now');
    expect(backoffText(makeKernel())).toBeNull();
    expect(suspendTitle(makeKernel())).toBe(
      'Checkpoint this kernel to disk and free its GPU'
    );
  });

  it('reports images no kernel owns', () => {
    const budget = {
      limit: null,
      used: 0,
      reserved: 0,
      available: null,
      orphaned_images: 2,
      orphaned_bytes: 3e9,
      orphaned_kernel_ids: ['a', 'b']
    };
    expect(orphansText(budget)).toBe(
      '2 checkpoint images (3.00 GB) belong to no kernel, left by a crash; `jupyter cedana gc` removes them.'
    );
  });

  it('shows the tier in the badge', () => {
    expect(badgeText(makeKernel())).toBe('running');
    expect(badgeText(makeKernel({ state: 'suspended', tier: 'offload' }))).toBe(
      'suspended · offload'
    );
  });
});

describe('statusText', () => {
  it('counts suspended kernels and GPU memory freed', async () => {
    const server = new FakeServer();
    server
      .on('GET', 'kernels', () => ({
        body: [
          makeKernel({ id: 'a' }),
          makeKernel({ id: 'b', state: 'suspended', tier: 'disk' })
        ]
      }))
      .on('GET', 'status', () => ({ body: makeStatus() }));
    const model = new CedanaModel({
      serverSettings: server.settings(),
      autoStart: false
    });
    await model.refresh();
    expect(statusText(model)).toBe('1 kernel suspended');
    model.handleEvent({
      schema_id: EVENT_SCHEMA_ID,
      kernel_id: 'b',
      action: 'suspended',
      gpu_memory_freed_bytes: 8e9
    });
    expect(statusText(model)).toBe('1 kernel suspended · 8.00 GB GPU freed');
    model.dispose();
  });
});
