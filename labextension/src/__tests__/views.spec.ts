import { indicatorView } from '../indicator';
import { CedanaModel } from '../model';
import { allowedActions, badgeText } from '../panel';
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

  it('says Restoring… (size) with progress', () => {
    const view = indicatorView(
      makeKernel({
        state: 'resuming',
        checkpoint_bytes: 4e9,
        progress: { phase: 'restore', fraction: 0.42 }
      })
    )!;
    expect(view.text).toBe('Restoring… (4.00 GB) 42 %');
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
